"""Unit tests for buffer.schema: round trip, wire format, one test per rejection reason, fuzz."""
import math
import random

import msgpack
import numpy as np
import pytest

from buffer.schema import (LOGPROB_FLOOR, MAX_TURNS, REASONS, SCHEMA_VERSION, Group, Limits, Sample, SchemaError,
                           check_version, decode, encode, validate)

pytestmark = pytest.mark.unit


def make_sample(n=8, seed=0, **kw):
    rng = np.random.default_rng(seed)
    fields = dict(response_ids=rng.integers(0, 1000, n).astype(np.int32),
                  behavior_logprobs=-rng.random(n).astype(np.float32),
                  reward=0.5 + seed, finish_reason="stop", version_start=3, version_end=4)
    fields.update(kw)
    return Sample(**fields)


def make_group(n_samples=4, **kw):
    fields = dict(group_id="g-123", prompt_id="p-7", actor_id="actor-0",
                  prompt_ids=np.arange(1, 11, dtype=np.int32),
                  samples=[make_sample(n=5 + i, seed=i) for i in range(n_samples)],
                  created_at=1_700_000_000.25, sent_at=1_700_000_001.5,
                  meta={"task": "gsm8k", "answer": "42", "level": 3, "weight": 0.5, "hard": True})
    fields.update(kw)
    return Group(**fields)


def wire(group=None):
    """The raw msgpack map of a valid message, for crafting bad messages."""
    return msgpack.unpackb(encode(group or make_group()), raw=False)


def pack(msg):
    return msgpack.packb(msg, use_bin_type=True)


def reject(data, reason, field, limits=Limits()):
    with pytest.raises(SchemaError) as ei:
        decode(data, limits)
    assert ei.value.reason == reason, str(ei.value)
    assert field in str(ei.value), str(ei.value)
    return ei.value


# ------------------------------------------------------------------ happy path

def test_round_trip():
    g = make_group()
    g.samples.append(make_sample(n=0, finish_reason="length", seed=9))  # empty response allowed
    out = decode(encode(g))
    assert out == g
    for a, b in zip(out.samples, g.samples):
        assert a.response_ids.dtype == np.int32 and a.behavior_logprobs.dtype == np.float32
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
        assert type(a.reward) is float and a.reward == b.reward
        assert (a.finish_reason, a.version_start, a.version_end) == (b.finish_reason, b.version_start, b.version_end)
    assert out.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(out.prompt_ids, g.prompt_ids)
    assert out.created_at == g.created_at and out.sent_at == g.sent_at and out.meta == g.meta
    assert (out.group_id, out.prompt_id, out.actor_id) == ("g-123", "p-7", "actor-0")
    assert out.version_start == 3 and out.version_end == 4
    assert out.num_tokens == 10 * 5 + sum(5 + i for i in range(4)) + 0
    assert not out.prompt_ids.flags.writeable  # documented: read-only views


def test_arrays_are_raw_bytes():
    raw = msgpack.unpackb(encode(make_group()), raw=True)
    assert raw[b"schema"] == SCHEMA_VERSION
    assert type(raw[b"p"]) is bytes and len(raw[b"p"]) == 10 * 4
    s0 = raw[b"s"][0]
    assert type(s0[b"r"]) is bytes and type(s0[b"lp"]) is bytes
    assert np.frombuffer(s0[b"lp"], "<f4").tolist() == make_group().samples[0].behavior_logprobs.tolist()


def test_big_endian_input_encodes_little_endian():
    g = make_group(prompt_ids=np.arange(1, 11, dtype=">i4"))
    np.testing.assert_array_equal(decode(encode(g)).prompt_ids, np.arange(1, 11))


def test_vocab_limit_accepts_in_range():
    decode(encode(make_group()), Limits(vocab_size=1000))


# ------------------------------------------------------------------ one test per reason

def test_malformed_bytes():
    reject(b"\x00garbage", "malformed", "message")


def test_not_a_map():
    reject(pack([1, 2, 3]), "malformed", "message")


def test_schema_version():
    m = wire()
    m["schema"] = SCHEMA_VERSION + 1
    reject(pack(m), "schema_version", "schema")


def test_missing_field():
    m = wire()
    del m["s"][1]["rw"]
    reject(pack(m), "missing_field", "samples[1].reward")
    m = wire()
    del m["gid"]
    reject(pack(m), "missing_field", "group_id")


def test_bad_type():
    m = wire()
    m["s"][0]["vs"] = "3"
    reject(pack(m), "bad_type", "samples[0].version_start")
    m = wire()
    m["p"] = m["p"][:-1]  # not a multiple of 4
    reject(pack(m), "bad_type", "prompt_ids")
    m = wire()
    m["m"]["nested"] = [1, 2]
    reject(pack(m), "bad_type", "meta")


def test_nan_reward():
    m = wire()
    m["s"][2]["rw"] = float("nan")
    reject(pack(m), "non_finite", "samples[2].reward")


def test_inf_logprob():
    m = wire()
    lp = np.frombuffer(m["s"][1]["lp"], "<f4").copy()
    lp[3] = -np.inf
    m["s"][1]["lp"] = lp.tobytes()
    reject(pack(m), "non_finite", "samples[1].behavior_logprobs[3]")


def test_length_mismatch():
    m = wire()
    m["s"][3]["lp"] = m["s"][3]["lp"][:-4]
    e = reject(pack(m), "length_mismatch", "samples[3].behavior_logprobs")
    assert "length 7 != response_ids length 8" in str(e)


def test_out_of_vocab():
    m = wire()
    r = np.frombuffer(m["s"][0]["r"], "<i4").copy()
    r[1] = 1000
    m["s"][0]["r"] = r.tobytes()
    reject(pack(m), "out_of_vocab", "samples[0].response_ids", Limits(vocab_size=1000))
    m["p"] = np.array([5, -1], "<i4").tobytes()  # negative ids are out of vocab even without a vocab
    reject(pack(m), "out_of_vocab", "prompt_ids")


def test_oversized_message():
    data = encode(make_group())
    reject(data, "too_large", "message", Limits(max_message_bytes=len(data) - 1))


def test_too_many_samples():
    reject(encode(make_group(n_samples=3)), "too_large", "samples", Limits(max_samples=2))
    # far over the limit: rejected by msgpack's container cap before any allocation
    reject(encode(make_group(n_samples=50)), "too_large", "message", Limits(max_samples=2))


def test_a_group_of_another_size_than_the_jobs_is_refused():
    """Every group has exactly actors.n samples: one short (or long) would make the step's rows uneven, and
    `split_rows` fails every learner rank of a job with an even number of them (a 2-rank job died of one
    7-sample group from a broken actor)."""
    lim = Limits(group_size=4)
    assert len(decode(encode(make_group(n_samples=4)), lim).samples) == 4
    for n in (3, 5):
        e = reject(encode(make_group(n_samples=n)), "bad_value", "samples", lim)
        assert f"{n} samples" in str(e) and "actors.n = 4" in str(e)
    assert len(decode(encode(make_group(n_samples=3))).samples) == 3  # no job size given: any size


def test_too_many_tokens():
    reject(encode(make_group()), "too_large", "prompt_ids", Limits(max_prompt_tokens=9))
    reject(encode(make_group()), "too_large", "samples[0].response_ids", Limits(max_response_tokens=4))


def test_bad_finish_reason():
    m = wire()
    m["s"][2]["fr"] = "eos"
    reject(pack(m), "bad_value", "samples[2].finish_reason")


def test_version_end_before_start():
    m = wire()
    m["s"][1]["ve"] = 2
    reject(pack(m), "bad_value", "samples[1].version_end")


def test_other_bad_values():
    m = wire()
    m["s"][0]["vs"] = -1
    reject(pack(m), "bad_value", "samples[0].version_start")
    m = wire()
    m["p"] = b""
    reject(pack(m), "bad_value", "prompt_ids")
    m = wire()
    m["s"][0]["lp"] = np.full(5, 0.5, "<f4").tobytes()
    reject(pack(m), "logprob_range", "samples[0].behavior_logprobs[0]")
    m = wire()
    m["s"] = []
    reject(pack(m), "bad_value", "samples")


def test_tiny_positive_logprob_tolerated():
    g = make_group()
    g.samples[0].behavior_logprobs[0] = 5e-5
    decode(encode(g))


def test_logprob_below_the_floor():
    """-100 is finite and <= 0, but no engine samples such a token: one would overflow the loss."""
    g = make_group()
    g.samples[2].behavior_logprobs[3] = -100.0
    reject(encode(g, Limits(min_logprob=-1000.0)), "logprob_range", "samples[2].behavior_logprobs[3]")
    g.samples[2].behavior_logprobs[3] = LOGPROB_FLOOR  # the floor itself is allowed
    decode(encode(g))


def test_reward_outside_the_jobs_range():
    limits = Limits(min_reward=-10.0, max_reward=10.0)
    for bad in (1e308, -10.5):
        m = wire()
        m["s"][1]["rw"] = bad
        e = reject(pack(m), "reward_range", "samples[1].reward", limits)
        assert "[-10.0, 10.0]" in str(e)
    m = wire()
    m["s"][1]["rw"] = 10.0  # the bounds are inside the range
    decode(pack(m), limits)
    with pytest.raises(ValueError, match="min_reward"):
        Limits(min_reward=1.0, max_reward=1.0)


def test_sample_longer_than_the_models_positions():
    g = make_group()  # prompt 10 tokens, responses 5..8
    decode(encode(g), Limits(max_positions=18))
    e = reject(encode(g), "too_large", "samples[3]", Limits(max_positions=17))
    assert "prompt 10 + response 8 tokens > the model's 17 positions" in str(e)


def test_version_ahead_of_the_newest_weights_sent():
    g = make_group()  # samples at versions 3..4
    check_version(g, 4)
    with pytest.raises(SchemaError) as ei:
        check_version(g, 3)
    assert ei.value.reason == "version_ahead" and "samples[0].version_end: 4" in str(ei.value)
    g.samples[1].version_start = g.samples[1].version_end = 9
    with pytest.raises(SchemaError) as ei:
        check_version(g, 4)
    assert "samples[1].version_start: 9 is ahead of the newest weights sent, version 4" in str(ei.value)


def test_encode_validates_early():
    g = make_group()
    g.samples[0].reward = math.inf
    with pytest.raises(SchemaError) as ei:
        encode(g)
    assert ei.value.reason == "non_finite" and "samples[0].reward" in str(ei.value)
    g = make_group(prompt_ids=np.arange(3))  # int64: no silent casting
    with pytest.raises(SchemaError) as ei:
        validate(g)
    assert ei.value.reason == "bad_type" and "prompt_ids" in str(ei.value)


def test_reasons_are_stable():
    assert REASONS == ("malformed", "schema_version", "missing_field", "bad_type", "length_mismatch",
                       "non_finite", "out_of_vocab", "too_large", "bad_value",
                       "logprob_range", "reward_range", "version_ahead")
    assert issubclass(SchemaError, ValueError)


# ------------------------------------------------------------------ multi-turn samples

MASK = [1, 1, 1, 0, 0, 1, 1, 0, 1, 1]     # three model turns around two environment spans
TURNS = [0, 3, 3, 5, 3, 4, 8, 4, 4]       # (offset, version_start, version_end) per turn


def make_multi_turn(**kw):
    mask = np.array(MASK, np.uint8)
    lp = np.where(mask == 1, -np.linspace(0.1, 1.0, len(mask)), 0.0).astype(np.float32)
    fields = dict(response_ids=np.arange(10, 20, dtype=np.int32), behavior_logprobs=lp, reward=1.0,
                  finish_reason="stop", version_start=3, version_end=4, loss_mask=mask,
                  turns=np.array(TURNS, np.int32), end_reason="answered")
    fields.update(kw)
    return Sample(**fields)


def multi_turn_wire(**kw):
    """The raw msgpack map of a valid message whose sample 0 is multi-turn."""
    g = make_group()
    g.samples[0] = make_multi_turn(**kw)
    return wire(g)


def test_multi_turn_round_trip():
    g = make_group()
    g.samples[1] = make_multi_turn()
    out = decode(encode(g))
    assert out == g
    s = out.samples[1]
    assert s.loss_mask.dtype == np.uint8 and s.turns.dtype == np.int32 and s.end_reason == "answered"
    np.testing.assert_array_equal(s.loss_mask, MASK)
    np.testing.assert_array_equal(s.turns, TURNS)
    assert not s.loss_mask.flags.writeable and not s.turns.flags.writeable  # read-only views, like the others
    assert out.samples[0].loss_mask is None and out.samples[0].turns is None and out.samples[0].end_reason is None
    assert out != decode(encode(make_group()))  # the new fields take part in equality
    raw = msgpack.unpackb(encode(g), raw=False)["s"]
    assert type(raw[1]["mk"]) is bytes and len(raw[1]["mk"]) == len(MASK) and raw[1]["er"] == "answered"
    assert np.frombuffer(raw[1]["tn"], "<i4").tolist() == TURNS
    assert not {"mk", "tn", "er"} & set(raw[0])  # a single-turn sample is sent as before
    one = Sample(**{**vars(make_multi_turn()), "turns": None, "end_reason": None})  # each field on its own
    g.samples[1] = one
    assert decode(encode(g)).samples[1] == one
    g.samples[1] = make_multi_turn(loss_mask=None)
    assert decode(encode(g)).samples[1].loss_mask is None


def test_a_message_without_the_multi_turn_keys_decodes_with_none():
    m = wire()
    assert not any({"mk", "tn", "er"} & set(s) for s in m["s"])
    m["s"][0]["zz"] = "a key this reader does not know"  # ignored, as always
    for s in decode(pack(m)).samples:
        assert (s.loss_mask, s.turns, s.end_reason) == (None, None, None)


@pytest.mark.parametrize("change,reason,field", [
    (lambda m: m.update(mk=m["mk"][:-1]), "length_mismatch", "samples[0].loss_mask: length 9"),
    (lambda m: m.update(mk=b""), "length_mismatch", "samples[0].loss_mask: length 0"),
    (lambda m: m.update(mk=bytes([1, 1, 1, 2, 0, 1, 1, 0, 1, 1])), "bad_value", "samples[0].loss_mask[3]: 2"),
    (lambda m: m.update(mk=bytes([0, 1, 1, 0, 0, 1, 1, 0, 1, 1]), tn=np.array([1, 3, 3], "<i4").tobytes()),
     "bad_value", "samples[0].loss_mask[0]"),
    (lambda m: m.update(mk="not bytes"), "bad_type", "samples[0].loss_mask"),
    (lambda m: m.update(lp=np.where(np.array(MASK) == 1, -0.5, -0.25).astype("<f4").tobytes()),
     "bad_value", "samples[0].behavior_logprobs[3]"),
])
def test_bad_loss_mask(change, reason, field):
    m = multi_turn_wire()
    change(m["s"][0])
    e = reject(pack(m), reason, field)
    if "behavior_logprobs" in field:
        assert "loss_mask[3] is 0" in str(e)


def test_an_empty_loss_mask_and_an_in_memory_mask_of_another_dtype_are_refused():
    g = make_group()
    g.samples[2] = make_multi_turn(response_ids=np.zeros(0, np.int32), behavior_logprobs=np.zeros(0, np.float32),
                                   loss_mask=np.zeros(0, np.uint8), turns=None)
    with pytest.raises(SchemaError, match=r"samples\[2\].loss_mask: empty") as ei:
        encode(g)
    assert ei.value.reason == "bad_value"
    for bad in (np.array(MASK, bool), np.array(MASK, np.int32), np.array([MASK], np.uint8)):
        g.samples[2] = make_multi_turn(loss_mask=bad)
        with pytest.raises(SchemaError, match=r"samples\[2\].loss_mask: expected 1-D uint8") as ei:
            encode(g)
        assert ei.value.reason == "bad_type"


def _tn(*values):
    return np.array(values, "<i4").tobytes()


@pytest.mark.parametrize("tn,reason,field", [
    (_tn(0, 3, 3, 5, 3), "length_mismatch", "samples[0].turns: length 5"),
    (b"", "bad_value", "samples[0].turns: 0 turns"),
    (b"\x00" * 6, "bad_type", "samples[0].turns"),
    (_tn(1, 3, 4), "bad_value", "samples[0].turns[0]: offset 1"),
    (_tn(0, 3, 3, 5, 3, 4, 5, 4, 4), "bad_value", "samples[0].turns[6]: offset 5"),
    (_tn(0, 3, 3, 2, 4, 4, 1, 4, 4), "bad_value", "samples[0].turns[6]: offset 1"),
    (_tn(0, 3, 3, 10, 4, 4), "bad_value", "samples[0].turns[3]: offset 10 not within the response's 10"),
    (_tn(0, 3, 3, 4, 4, 4), "bad_value", "samples[0].turns[3]: turn 1 starts at offset 4"),
    (_tn(0, 3, 3, 5, 4, 3, 8, 4, 4), "bad_value", "samples[0].turns[5]: turn 1's version_end 3"),
    (_tn(0, 4, 4, 5, 4, 4), "bad_value", "samples[0].version_start: 3 != the turns' earliest version_start 4"),
    (_tn(0, 3, 3, 5, 3, 3), "bad_value", "samples[0].version_end: 4 != the turns' latest version_end 3"),
    (_tn(*[v for j in range(MAX_TURNS + 1) for v in (j, 3, 4)]), "too_large", "samples[0].turns: 257 turns"),
])
def test_bad_turns(tn, reason, field):
    m = multi_turn_wire()
    m["s"][0]["tn"] = tn
    if "257 turns" in field:  # a response long enough for them, every token its own turn
        n = MAX_TURNS + 1
        m["s"][0].update(r=np.zeros(n, "<i4").tobytes(), lp=np.full(n, -0.5, "<f4").tobytes(),
                         mk=np.ones(n, np.uint8).tobytes())
    reject(pack(m), reason, field)


def test_turns_without_a_loss_mask_need_no_model_token_check():
    m = multi_turn_wire()
    del m["s"][0]["mk"]
    m["s"][0]["lp"] = np.full(10, -0.5, "<f4").tobytes()
    m["s"][0]["tn"] = _tn(0, 3, 3, 4, 4, 4)  # offset 4 is an environment token only under the mask
    assert decode(pack(m)).samples[0].loss_mask is None


def test_the_most_turns_fit_the_unpack_caps():
    """A sample of MAX_TURNS one-token turns passes msgpack's bin cap even when the job's token limits are small."""
    n = MAX_TURNS
    g = make_group()
    g.samples[0] = make_multi_turn(response_ids=np.zeros(n, np.int32), behavior_logprobs=np.full(n, -0.5, np.float32),
                                   loss_mask=np.ones(n, np.uint8),
                                   turns=np.array([v for j in range(n) for v in (j, 3, 4)], np.int32))
    limits = Limits(max_prompt_tokens=16, max_response_tokens=n)
    assert decode(encode(g, limits), limits) == g


@pytest.mark.parametrize("er,reason", [("", "bad_value"), ("Answered", "bad_value"), ("tool timeout", "bad_value"),
                                       ("x" * 65, "bad_value"), ("answered\n", "bad_value"), (3, "bad_type")])
def test_bad_end_reason(er, reason):
    m = multi_turn_wire()
    m["s"][0]["er"] = er
    reject(pack(m), reason, "samples[0].end_reason")
    m["s"][0]["er"] = "x" * 64  # the longest allowed
    assert decode(pack(m)).samples[0].end_reason == "x" * 64


# ------------------------------------------------------------------ fuzz (hypothesis-free)

def _decode_or_schema_error(data, limits=Limits(vocab_size=1000)):
    try:
        return decode(data, limits)
    except SchemaError as e:
        assert e.reason in REASONS
        return None


def test_fuzz_random_bytes():
    rng = random.Random(1234)
    for _ in range(500):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        with pytest.raises(SchemaError) as ei:
            decode(data)
        assert ei.value.reason in REASONS


def test_fuzz_truncations():
    rng = random.Random(99)
    data = encode(make_group())
    for _ in range(500):
        with pytest.raises(SchemaError) as ei:
            decode(data[:rng.randrange(len(data))])
        assert ei.value.reason in REASONS


def test_fuzz_byte_flips():
    # a corrupted message may still be valid; it must never raise anything but SchemaError
    rng = random.Random(7)
    data = encode(make_group())
    for _ in range(500):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.getrandbits(8)
        _decode_or_schema_error(bytes(buf))


def test_trusted_decode_skips_only_value_checks():
    g = Group(group_id="t", prompt_id="p", actor_id="a", prompt_ids=np.arange(3, dtype=np.int32), created_at=1.0,
              samples=[Sample(response_ids=np.arange(2, dtype=np.int32), behavior_logprobs=np.full(2, -1.0, np.float32),
                              reward=0.5, finish_reason="stop", version_start=1, version_end=1)])
    data = encode(g)
    assert decode(data, trusted=True) == decode(data) == g
    bad = msgpack.unpackb(data, raw=False)
    bad["s"][0]["rw"] = float("nan")
    nan = msgpack.packb(bad)
    with pytest.raises(SchemaError):
        decode(nan)
    assert math.isnan(decode(nan, trusted=True).samples[0].reward)  # values unchecked: only for stored bytes
    with pytest.raises(SchemaError):
        decode(b"\xc1garbage", trusted=True)  # structure is still parsed strictly

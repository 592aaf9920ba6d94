"""Wire schema for rollout data: one message = one prompt group (n samples of one prompt).

Wire contract (SCHEMA_VERSION = 1). A message is one msgpack map with short str keys:

    schema: int (== SCHEMA_VERSION)     gid: str group_id (1..128 chars, idempotency key)
    pid: str prompt_id (1..256)        aid: str actor_id (1..128)
    p: bin prompt_ids, '<i4' raw       ca: float created_at      sa: float sent_at
    m: map str -> str|int|float|bool (<= 64 keys)
    s: array of maps, one per sample:
        r: bin response_ids '<i4'      lp: bin behavior_logprobs '<f4' (one per token, in [LOGPROB_FLOOR, 0])
        rw: float reward (in Limits' range)  fr: str finish_reason ("stop" | "length" | "abort")
        vs: int version_start >= 0     ve: int version_end >= version_start
      optional (multi-turn samples; absent = a single-turn sample, as every message before them):
        mk: bin loss_mask, raw uint8, one per response token: 1 = the model sampled it, 0 = an
            environment token (tool output, chat-template glue), whose behavior logprob is exactly 0.0
        tn: bin turns '<i4', 3 per model turn: (offset of its first token in the response,
            version_start, version_end); the sample's versions are the turns' min and max
        er: str end_reason, why the episode ended ("answered", "max_turns", ...; 1..64 of [a-z0-9_])

Numeric arrays always travel as raw little-endian bytes (never msgpack lists): compact,
and decoding is a zero-copy np.frombuffer. Unknown keys are ignored (additive changes do
not need a version bump); anything else incompatible bumps SCHEMA_VERSION.

decode() validates everything at the trust boundary (types, and values against the job's Limits;
the ingest also applies check_version) and raises SchemaError whose .reason
(one of REASONS) is a stable counter label. Arrays returned by decode() are READ-ONLY
views into the message bytes (np.frombuffer); call .copy() before mutating them.
encode() runs the same validate(), so a misbehaving actor fails early with the same errors.
In-memory arrays must already be 1-D int32 / float32 (any byte order), loss_mask 1-D uint8;
no silent casting.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import msgpack
import numpy as np

SCHEMA_VERSION = 1
REASONS = ("malformed", "schema_version", "missing_field", "bad_type", "length_mismatch",
           "non_finite", "out_of_vocab", "too_large", "bad_value",
           # values judged against the job (Limits, and the newest weights sent), not only types
           "logprob_range", "reward_range", "version_ahead")
FINISH_REASONS = ("stop", "length", "abort")
MAX_META_KEYS = 64
MAX_META_STR = 65536          # chars per meta key/value; ground-truth strings can be long-ish
LOGPROB_EPS = 1e-4            # tolerate tiny positive logprobs from numerical noise
# Lowest behavior logprob accepted. Engines report the logprob of a token they sampled, under the
# sampling distribution (after temperature): one below -50 is drawn with probability at most
# vocab * e^-50 < 1e-16 per token, so no engine produces it; a forged -100 only drives the
# importance ratio exp(logprob - behavior) to its clamp.
LOGPROB_FLOOR = -50.0
MAX_TURNS = 256               # model turns of one multi-turn sample
_END_REASON_RE = re.compile(r"[a-z0-9_]{1,64}")  # a label for counters and logs, never free text
_INT32_MAX = 2**31 - 1


class SchemaError(ValueError):
    """Invalid message. .reason is a stable snake_case label from REASONS; str() names the field."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


@dataclass(kw_only=True, frozen=True)
class Limits:
    vocab_size: int | None = None      # ids must be in [0, vocab_size) when given
    max_prompt_tokens: int = 65536     # the ingest passes the job's data.max_prompt_length
    max_response_tokens: int = 65536   # the ingest passes the job's actors.max_tokens
    max_positions: int | None = None   # prompt + response tokens of one sample (the model's positions)
    max_samples: int = 1024
    group_size: int | None = None      # the ingest passes actors.n: a group of another size is refused (the
                                       # learner ranks' equal shares and GRPO's group baseline assume it)
    max_message_bytes: int = 64 * 2**20
    min_logprob: float = LOGPROB_FLOOR
    min_reward: float = -math.inf      # the ingest passes buffer.min_reward / buffer.max_reward
    max_reward: float = math.inf

    def __post_init__(self):
        if not self.min_reward < self.max_reward:
            raise ValueError(f"Limits: min_reward {self.min_reward} must be < max_reward {self.max_reward}")


def _arr_eq(a, b) -> bool:
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
            and np.array_equal(a, b))


def _opt_arr_eq(a, b) -> bool:
    return (a is None and b is None) or _arr_eq(a, b)


@dataclass(kw_only=True, eq=False)
class Sample:
    response_ids: np.ndarray        # int32
    behavior_logprobs: np.ndarray   # float32, one per response token
    reward: float
    finish_reason: str
    version_start: int
    version_end: int
    # multi-turn samples only (None: a single-turn sample, every response token the model's)
    loss_mask: np.ndarray | None = None   # uint8, one per response token: 1 model, 0 environment
    turns: np.ndarray | None = None       # int32, (offset, version_start, version_end) per model turn
    end_reason: str | None = None         # why the episode ended: "answered", "max_turns", ...

    def __eq__(self, other):  # dataclass eq would call bool() on an elementwise array compare
        if not isinstance(other, Sample):
            return NotImplemented
        return (_arr_eq(self.response_ids, other.response_ids)
                and _arr_eq(self.behavior_logprobs, other.behavior_logprobs)
                and _opt_arr_eq(self.loss_mask, other.loss_mask) and _opt_arr_eq(self.turns, other.turns)
                and (self.reward, self.finish_reason, self.version_start, self.version_end, self.end_reason)
                == (other.reward, other.finish_reason, other.version_start, other.version_end, other.end_reason))


@dataclass(kw_only=True, eq=False)
class Group:
    group_id: str
    prompt_id: str
    actor_id: str
    prompt_ids: np.ndarray          # int32, non-empty
    samples: list[Sample]
    created_at: float
    sent_at: float = 0.0            # set by the sender, not by encode()
    meta: dict = field(default_factory=dict)

    @property
    def version_start(self) -> int:
        return min(s.version_start for s in self.samples)

    @property
    def version_end(self) -> int:
        return max(s.version_end for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) * len(self.samples) + sum(len(s.response_ids) for s in self.samples)

    def __eq__(self, other):
        if not isinstance(other, Group):
            return NotImplemented
        return (_arr_eq(self.prompt_ids, other.prompt_ids) and self.samples == other.samples
                and (self.group_id, self.prompt_id, self.actor_id, self.created_at, self.sent_at, self.meta)
                == (other.group_id, other.prompt_id, other.actor_id, other.created_at, other.sent_at, other.meta))


# ---------------------------------------------------------------- validation helpers

def _str(v, name: str, max_len: int) -> None:
    if not isinstance(v, str):
        raise SchemaError("bad_type", f"{name}: expected str, got {type(v).__name__}")
    if not 1 <= len(v) <= max_len:
        raise SchemaError("bad_value", f"{name}: length {len(v)} not in [1, {max_len}]")


def _int(v, name: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool):  # bool is an int subclass; reject it
        raise SchemaError("bad_type", f"{name}: expected int, got {type(v).__name__}")
    if not 0 <= v < 2**63:  # must fit msgpack's int64 so every reader sees the same value
        raise SchemaError("bad_value", f"{name}: {v} not in [0, 2**63)")


def _float(v, name: str) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise SchemaError("bad_type", f"{name}: expected float, got {type(v).__name__}")
    if not math.isfinite(v):
        raise SchemaError("non_finite", f"{name}: {v} is not finite")


def _array(a, name: str, kind: str, max_len: int) -> None:
    if not isinstance(a, np.ndarray):
        raise SchemaError("bad_type", f"{name}: expected numpy array, got {type(a).__name__}")
    want = "int32" if kind == "i" else "float32"
    if a.ndim != 1 or a.dtype.kind != kind or a.dtype.itemsize != 4:
        raise SchemaError("bad_type", f"{name}: expected 1-D {want}, got {a.ndim}-D {a.dtype}")
    if len(a) > max_len:
        raise SchemaError("too_large", f"{name}: length {len(a)} > limit {max_len}")


def _ids(a, name: str, limits: Limits, max_len: int) -> None:
    _array(a, name, "i", max_len)
    if len(a):
        lo, hi = int(a.min()), int(a.max())
        top = limits.vocab_size if limits.vocab_size is not None else _INT32_MAX + 1
        if lo < 0 or hi >= top:
            bad = lo if lo < 0 else hi
            raise SchemaError("out_of_vocab", f"{name}: token id {bad} not in [0, {top})")


def _loss_mask(s, n: str) -> None:
    """A multi-turn sample's loss mask (module docstring); response_ids and behavior_logprobs are valid."""
    mk, lp = s.loss_mask, s.behavior_logprobs
    if not isinstance(mk, np.ndarray):
        raise SchemaError("bad_type", f"{n}.loss_mask: expected numpy array, got {type(mk).__name__}")
    if mk.ndim != 1 or mk.dtype != np.uint8:
        raise SchemaError("bad_type", f"{n}.loss_mask: expected 1-D uint8, got {mk.ndim}-D {mk.dtype}")
    if len(mk) != len(s.response_ids):
        raise SchemaError("length_mismatch", f"{n}.loss_mask: length {len(mk)} != "
                                             f"response_ids length {len(s.response_ids)}")
    if not len(mk):  # nothing the model sampled: a sample without a first turn
        raise SchemaError("bad_value", f"{n}.loss_mask: empty (a response starts with the model's turn)")
    if (bad := np.flatnonzero(mk > 1)).size:
        j = int(bad[0])
        raise SchemaError("bad_value", f"{n}.loss_mask[{j}]: {mk[j]} is not 0 or 1")
    if mk[0] != 1:
        raise SchemaError("bad_value", f"{n}.loss_mask[0]: 0 (a response starts with the model's turn)")
    # an environment token was not sampled, so it has no behavior logprob: exactly 0.0 marks that on the wire
    if (bad := np.flatnonzero((mk == 0) & (lp != 0))).size:
        j = int(bad[0])
        raise SchemaError("bad_value", f"{n}.behavior_logprobs[{j}]: {lp[j]} where loss_mask[{j}] is 0 "
                                       f"(an environment token carries no behavior logprob: 0.0)")


def _turns(s, n: str) -> None:
    """A multi-turn sample's turns (module docstring); its versions and loss mask (if any) are valid."""
    tn = s.turns
    _array(tn, f"{n}.turns", "i", _INT32_MAX)  # dtype and shape only: the number of turns is judged below
    if len(tn) % 3:
        raise SchemaError("length_mismatch", f"{n}.turns: length {len(tn)} is not 3 per turn "
                                             f"(offset, version_start, version_end)")
    k = len(tn) // 3
    if not 1 <= k <= MAX_TURNS:
        raise SchemaError("too_large" if k else "bad_value", f"{n}.turns: {k} turns not in [1, {MAX_TURNS}]")
    off, vs, ve = (tn[c::3].astype(np.int64) for c in range(3))
    if off[0] != 0:
        raise SchemaError("bad_value", f"{n}.turns[0]: offset {off[0]} != 0 (a response starts with the model's turn)")
    if (bad := np.flatnonzero(np.diff(off) <= 0)).size:
        j = int(bad[0]) + 1
        raise SchemaError("bad_value", f"{n}.turns[{3 * j}]: offset {off[j]} not after the previous turn's "
                                       f"{off[j - 1]}")
    if off[-1] >= len(s.response_ids):  # increasing: the last offset is the largest
        raise SchemaError("bad_value", f"{n}.turns[{3 * (k - 1)}]: offset {off[-1]} not within the response's "
                                       f"{len(s.response_ids)} tokens")
    if s.loss_mask is not None and (bad := np.flatnonzero(s.loss_mask[off] != 1)).size:
        j = int(bad[0])
        raise SchemaError("bad_value", f"{n}.turns[{3 * j}]: turn {j} starts at offset {off[j]}, "
                                       f"an environment token (loss_mask 0)")
    if (bad := np.flatnonzero(vs > ve)).size:
        j = int(bad[0])
        raise SchemaError("bad_value", f"{n}.turns[{3 * j + 2}]: turn {j}'s version_end {ve[j]} < "
                                       f"its version_start {vs[j]}")
    # the sample-level span bounds every turn's, so check_version and the staleness filter need only it
    if s.version_start != int(vs.min()):
        raise SchemaError("bad_value", f"{n}.version_start: {s.version_start} != the turns' earliest "
                                       f"version_start {int(vs.min())}")
    if s.version_end != int(ve.max()):
        raise SchemaError("bad_value", f"{n}.version_end: {s.version_end} != the turns' latest "
                                       f"version_end {int(ve.max())}")


def _end_reason(v, name: str) -> None:
    if not isinstance(v, str):
        raise SchemaError("bad_type", f"{name}: expected str, got {type(v).__name__}")
    if not _END_REASON_RE.fullmatch(v):
        raise SchemaError("bad_value", f"{name}: {v[:80]!r} is not 1..64 characters of [a-z0-9_]")


def _validate_sample(s, i: int, limits: Limits) -> None:
    n = f"samples[{i}]"
    if not isinstance(s, Sample):
        raise SchemaError("bad_type", f"{n}: expected Sample, got {type(s).__name__}")
    _ids(s.response_ids, f"{n}.response_ids", limits, limits.max_response_tokens)
    lp = s.behavior_logprobs
    _array(lp, f"{n}.behavior_logprobs", "f", limits.max_response_tokens)
    if len(lp) != len(s.response_ids):
        raise SchemaError("length_mismatch", f"{n}.behavior_logprobs: length {len(lp)} != "
                                             f"response_ids length {len(s.response_ids)}")
    if len(lp):
        finite = np.isfinite(lp)
        if not finite.all():
            j = int(np.argmin(finite))
            raise SchemaError("non_finite", f"{n}.behavior_logprobs[{j}]: {lp[j]} is not finite")
        lo, hi = float(lp.min()), float(lp.max())
        if hi > LOGPROB_EPS or lo < limits.min_logprob:
            j = int(np.argmax(lp)) if hi > LOGPROB_EPS else int(np.argmin(lp))
            raise SchemaError("logprob_range", f"{n}.behavior_logprobs[{j}]: {lp[j]} not in "
                                               f"[{limits.min_logprob}, 0] (no engine samples such a token)")
    _float(s.reward, f"{n}.reward")
    if not limits.min_reward <= s.reward <= limits.max_reward:
        raise SchemaError("reward_range", f"{n}.reward: {s.reward:.6g} not in the job's range "
                                          f"[{limits.min_reward}, {limits.max_reward}] (buffer.min_reward/max_reward)")
    if not isinstance(s.finish_reason, str):
        raise SchemaError("bad_type", f"{n}.finish_reason: expected str, "
                                      f"got {type(s.finish_reason).__name__}")
    if s.finish_reason not in FINISH_REASONS:
        raise SchemaError("bad_value", f"{n}.finish_reason: {s.finish_reason[:32]!r} not in {FINISH_REASONS}")
    _int(s.version_start, f"{n}.version_start")
    _int(s.version_end, f"{n}.version_end")
    if s.version_end < s.version_start:
        raise SchemaError("bad_value", f"{n}.version_end: {s.version_end} < version_start {s.version_start}")
    if s.loss_mask is not None:
        _loss_mask(s, n)
    if s.turns is not None:
        _turns(s, n)
    if s.end_reason is not None:
        _end_reason(s.end_reason, f"{n}.end_reason")


def validate(group: Group, limits: Limits = Limits()) -> None:
    """Check every invariant of an in-memory Group; raise SchemaError on the first violation."""
    if not isinstance(group, Group):
        raise SchemaError("bad_type", f"group: expected Group, got {type(group).__name__}")
    _str(group.group_id, "group_id", 128)
    _str(group.prompt_id, "prompt_id", 256)
    _str(group.actor_id, "actor_id", 128)
    _ids(group.prompt_ids, "prompt_ids", limits, limits.max_prompt_tokens)
    if len(group.prompt_ids) == 0:
        raise SchemaError("bad_value", "prompt_ids: empty")
    _float(group.created_at, "created_at")
    _float(group.sent_at, "sent_at")
    if not isinstance(group.samples, list):
        raise SchemaError("bad_type", f"samples: expected list, got {type(group.samples).__name__}")
    if not group.samples:
        raise SchemaError("bad_value", "samples: empty")
    if len(group.samples) > limits.max_samples:
        raise SchemaError("too_large", f"samples: {len(group.samples)} samples > limit {limits.max_samples}")
    if limits.group_size is not None and len(group.samples) != limits.group_size:
        raise SchemaError("bad_value", f"samples: {len(group.samples)} samples, the job's groups have "
                                       f"actors.n = {limits.group_size}")
    for i, s in enumerate(group.samples):
        _validate_sample(s, i, limits)
        if limits.max_positions is not None and len(group.prompt_ids) + len(s.response_ids) > limits.max_positions:
            raise SchemaError("too_large", f"samples[{i}]: prompt {len(group.prompt_ids)} + response "
                                           f"{len(s.response_ids)} tokens > the model's {limits.max_positions} positions")
    m = group.meta
    if not isinstance(m, dict):
        raise SchemaError("bad_type", f"meta: expected dict, got {type(m).__name__}")
    if len(m) > MAX_META_KEYS:
        raise SchemaError("too_large", f"meta: {len(m)} keys > limit {MAX_META_KEYS}")
    for k, v in m.items():
        if not isinstance(k, str):
            raise SchemaError("bad_type", f"meta: key {k!r} is not a str")
        if not isinstance(v, (str, int, float, bool)):
            raise SchemaError("bad_type", f"meta[{k[:64]!r}]: unsupported type {type(v).__name__}")
        if isinstance(v, int) and not -2**63 <= v < 2**64:
            raise SchemaError("bad_value", f"meta[{k[:64]!r}]: int {v} does not fit 64 bits")
        if isinstance(v, float) and not math.isfinite(v):
            raise SchemaError("non_finite", f"meta[{k[:64]!r}]: {v} is not finite")
        if len(k) > MAX_META_STR or (isinstance(v, str) and len(v) > MAX_META_STR):
            raise SchemaError("too_large", f"meta[{k[:64]!r}]: string longer than {MAX_META_STR}")


def check_version(group: Group, newest: int) -> None:
    """No sample may claim weights newer than `newest`, the latest version the publisher has begun
    to send (actors hold it before the learner's `version` moves): a later one is forged or corrupt,
    and would pass the staleness filter as fresher than on-policy."""
    for i, s in enumerate(group.samples):
        if s.version_end > newest:
            name = "version_start" if s.version_start > newest else "version_end"
            raise SchemaError("version_ahead", f"samples[{i}].{name}: {getattr(s, name)} is ahead of "
                                               f"the newest weights sent, version {newest}")


# ---------------------------------------------------------------- encode / decode

_LE_I4, _LE_F4 = np.dtype("<i4"), np.dtype("<f4")


def _sample_wire(s: Sample) -> dict:
    """One sample's wire map; the multi-turn keys only when set, so a single-turn message is unchanged."""
    out = {"r": np.ascontiguousarray(s.response_ids, _LE_I4).tobytes(),
           "lp": np.ascontiguousarray(s.behavior_logprobs, _LE_F4).tobytes(),
           "rw": float(s.reward), "fr": s.finish_reason, "vs": s.version_start, "ve": s.version_end}
    if s.loss_mask is not None:
        out["mk"] = np.ascontiguousarray(s.loss_mask, np.uint8).tobytes()
    if s.turns is not None:
        out["tn"] = np.ascontiguousarray(s.turns, _LE_I4).tobytes()
    if s.end_reason is not None:
        out["er"] = s.end_reason
    return out


def encode(group: Group, limits: Limits = Limits()) -> bytes:
    """Validate and serialize one group. Raises SchemaError (same reasons as decode)."""
    validate(group, limits)
    msg = {
        "schema": SCHEMA_VERSION, "gid": group.group_id, "pid": group.prompt_id, "aid": group.actor_id,
        "p": np.ascontiguousarray(group.prompt_ids, _LE_I4).tobytes(),
        "ca": float(group.created_at), "sa": float(group.sent_at), "m": dict(group.meta),
        "s": [_sample_wire(s) for s in group.samples],
    }
    try:
        out = msgpack.packb(msg, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # e.g. lone surrogates in a str
        raise SchemaError("bad_value", f"message: cannot encode: {e}") from None
    if len(out) > limits.max_message_bytes:
        raise SchemaError("too_large", f"message: {len(out)} bytes > limit {limits.max_message_bytes}")
    return out


_LIMIT_RE = re.compile(r"(\d+) exceeds max_(\w+)_len\((\d+)\)")


def _unpack(data, limits: Limits):
    # Cap every container so a hostile header cannot make msgpack preallocate a huge list/dict:
    # the caps are one past the legal maximum (so an off-by-one still reaches validate() and
    # gets a field-named message) and never more than the message length (a container
    # cannot legitimately declare more elements than there are bytes left).
    n = len(data)
    # the longest legal bin: prompt or response ids, or the turns' 3 int32 per turn
    caps = {"bin": 4 * (max(limits.max_prompt_tokens, limits.max_response_tokens, 3 * MAX_TURNS) + 1),
            "str": 4 * MAX_META_STR + 4, "array": limits.max_samples + 1, "map": MAX_META_KEYS + 1}
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0,
                               **{f"max_{k}_len": min(v, n) for k, v in caps.items()})
    except Exception as e:  # msgpack raises ValueError subclasses, but hostile input -> catch all
        m = _LIMIT_RE.search(str(e))
        if m and m.group(2) in caps and int(m.group(1)) > caps[m.group(2)]:
            raise SchemaError("too_large", f"message: msgpack {m.group(2)} of length {m.group(1)} "
                                           f"exceeds the limit {caps[m.group(2)]}") from None
        why = f"{type(e).__name__}: {str(e)[:200]}"
        raise SchemaError("malformed", f"message: cannot unpack msgpack: {why}") from None


def _get(d: dict, key: str, name: str, typ):
    if key not in d:
        raise SchemaError("missing_field", f"{name}: missing (wire key {key!r})")
    v = d[key]
    if not isinstance(v, typ):
        raise SchemaError("bad_type", f"{name}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _buf(d: dict, key: str, name: str, dtype: str) -> np.ndarray:
    b = _get(d, key, name, bytes)
    size = np.dtype(dtype).itemsize
    if len(b) % size:
        raise SchemaError("bad_type", f"{name}: byte length {len(b)} is not a multiple of {size}")
    return np.frombuffer(b, dtype=dtype)  # read-only zero-copy view; keeps `b` alive


def _opt_buf(d: dict, key: str, name: str, dtype: str) -> np.ndarray | None:
    """An optional array: None when the key is absent (a single-turn sample, or a message from before it)."""
    return _buf(d, key, name, dtype) if key in d else None


def decode(data: bytes, limits: Limits = Limits(), *, trusted: bool = False) -> Group:
    """Parse and fully validate one message. Arrays in the result are read-only views.

    `trusted=True` skips the value checks (structure is still parsed strictly): only for bytes this
    system already validated at its boundary, i.e. entries the ingest stored in the Redis stream.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError("malformed", f"message: expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:  # before unpacking: never parse an oversized blob
        raise SchemaError("too_large", f"message: {len(data)} bytes > limit {limits.max_message_bytes}")
    d = _unpack(bytes(data), limits)
    if not isinstance(d, dict):
        raise SchemaError("malformed", f"message: expected a msgpack map, got {type(d).__name__}")
    ver = _get(d, "schema", "schema", object)
    if type(ver) is not int or ver != SCHEMA_VERSION:  # 1.0 / True are not version 1
        raise SchemaError("schema_version", f"schema: version {ver!r:.40} != {SCHEMA_VERSION}")
    samples = []
    for i, s in enumerate(_get(d, "s", "samples", list)):
        n = f"samples[{i}]"
        if not isinstance(s, dict):
            raise SchemaError("bad_type", f"{n}: expected map, got {type(s).__name__}")
        samples.append(Sample(
            response_ids=_buf(s, "r", f"{n}.response_ids", "<i4"),
            behavior_logprobs=_buf(s, "lp", f"{n}.behavior_logprobs", "<f4"),
            reward=_get(s, "rw", f"{n}.reward", object),
            finish_reason=_get(s, "fr", f"{n}.finish_reason", object),
            version_start=_get(s, "vs", f"{n}.version_start", object),
            version_end=_get(s, "ve", f"{n}.version_end", object),
            loss_mask=_opt_buf(s, "mk", f"{n}.loss_mask", "u1"),
            turns=_opt_buf(s, "tn", f"{n}.turns", "<i4"),
            end_reason=s.get("er")))
    g = Group(group_id=_get(d, "gid", "group_id", object), prompt_id=_get(d, "pid", "prompt_id", object),
              actor_id=_get(d, "aid", "actor_id", object), prompt_ids=_buf(d, "p", "prompt_ids", "<i4"),
              samples=samples, created_at=_get(d, "ca", "created_at", object),
              sent_at=_get(d, "sa", "sent_at", object), meta=_get(d, "m", "meta", dict))
    if not trusted:
        validate(g, limits)  # field types/values are checked once, by the same code encode() uses
    # normalize ints that validate() accepted for float fields, so callers always see floats
    g.created_at, g.sent_at = float(g.created_at), float(g.sent_at)
    for s in samples:
        s.reward = float(s.reward)
    return g

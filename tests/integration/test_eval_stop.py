"""Held-out evaluation with actors.stop on the learner's HF engine (trainer.val_engine=learner, the default): the
HF engine does not apply stop strings, so the scored text is cut where vLLM would have ended the sample. Before,
the evaluation scored the whole response past the stop string, the actors' training samples ended at it: the
held-out reward measured another policy (the same 0.4215 at step 0 with stop strings as without)."""
from __future__ import annotations

from data.tasks import TaskConfig, val_prompts
from data.tiny_model import resolve_model_path
from engines.evaluate import cut_at_stop, evaluate_prompts
from engines.hf_engine import HFEngine


def test_cut_at_stop_keeps_the_first_stop_string():
    assert cut_at_stop("hgfa>dcba", ["a"]) == "hgfa"
    assert cut_at_stop("hgfa>dcba", ["a", "hg"]) == "hg"   # the stop string that ends first
    assert cut_at_stop("dcb", ["a"]) == "dcb" and cut_at_stop("dcba", []) == "dcba"


def test_held_out_answers_end_at_the_stop_strings_on_the_hf_engine():
    task = TaskConfig()
    engine = HFEngine(resolve_model_path("builtin:tiny-reverse", task))
    prompts = val_prompts(task)[:32]

    def run(stop):
        seen = []

        def score(_rec, text):
            seen.append(text)
            return 0.0

        evaluate_prompts(engine, prompts, score, samples=4, temperature=1.0, max_tokens=8, seed=0, stop=stop)
        return seen

    whole, cut = run(()), run(("a",))
    # the reverse task's answers hold an "a" mid-answer often enough for the check to bite
    assert any("a" in t[:-1] for t in whole), whole
    assert all("a" not in t[:-1] for t in cut), [t for t in cut if "a" in t[:-1]]
    assert [cut_at_stop(t, ["a"]) for t in whole] == cut   # same seed, same samples: only the cut differs

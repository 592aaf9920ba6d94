"""Generation engines shared by the rollout actors, the learner's evaluation and the sync baseline: the `Engine`
interface and its backends (`hf`: transformers; `vllm`: vLLM, streaming), chosen by `engines.backends.build_engine`."""

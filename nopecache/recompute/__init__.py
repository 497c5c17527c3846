"""Engine-agnostic selective recompute: policies (pure functions of a reuse layout) and the
layer loop behind two small protocols, used by the vLLM and transformers integrations."""

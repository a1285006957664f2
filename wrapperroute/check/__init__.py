"""The self-check used by ``wrapperroute check`` and by the test suite.

An embedded tiny causal LM, the losses people route (a fused cross-entropy reading ``lm_head.weight``,
Liger's chunked DPO and KTO, a hand-written ``torch.func`` chunked loss), the wrappers to route through, and a
rank-side runner that measures gradient truth: every parameter's gradient compared across ranks and against a
single process on the concatenated global batch.
"""

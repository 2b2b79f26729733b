"""The operations a model is written in: norm, rotary embedding, linear(s), attention, routing, routed experts
and the gated delta-net mix. Each picks a kernel or its torch form from the weight's type, the device and the
number of tokens, so a model file is plain math and a kernel or tensor type is added here, not in every model.
"""

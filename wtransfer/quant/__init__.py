"""Quantized weights: the FP8 scheme an engine stores (`fp8`), the trainer-side source that
quantizes before sending (`source`), and the engine-side target that quantizes what arrives in
the checkpoint's dtype (`target`)."""

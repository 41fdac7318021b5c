"""Serving: the HTTP server and its request bodies, joining from a peer, and prefill/decode
disaggregation with its KV hand-over."""

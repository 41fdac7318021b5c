"""Helpers shared by the inference-engine tests."""


async def collect(engine, rid, prompt, params, progress=None):
    """Run one request to the end; record its token count in `progress` as it streams."""
    last = None
    async for out in engine.generate(prompt, params, request_id=rid):
        last = out
        if progress is not None:
            progress[rid] = len(out.outputs[0].token_ids)
    return last

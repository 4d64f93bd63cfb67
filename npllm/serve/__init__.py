"""`npllm serve`: OpenAI's HTTP API over the continuous-batching engine.

    protocol   request bodies checked into engine Requests, results into OpenAI response bodies (no HTTP here)
    engine     one thread that steps the ContinuousEngine, fed by an inbox of submits and cancels
    app        the Starlette application and the uvicorn runner (needs the `serve` extra: Starlette, uvicorn)

docs/serve.md describes the endpoints, the options, the measured throughput and how to deploy it.
"""

"""`ridgeline serve`: the OpenAI-compatible HTTP server, above the engine and the model
clients (it imports `ridgeline.engine` to generate and `ridgeline.llm` for chat templates
and tool-call parsing; neither imports it).

    from ridgeline.serve.app import ServerThread, build_engines, create_app
    app = create_app(build_engines(EngineConfig(model="default"), "default"))
    with ServerThread(app) as server:           # uvicorn on a free loopback port
        OpenAI(base_url=server.base_url, api_key="-").chat.completions.create(...)

Modules: `app` (`create_app`: the routes, wired), `gate` (request id, API key, body
limit, the answer to a bug), `served` (`ServedModel`, `build_engines`), `generation`
(engine requests and their outputs), `streaming` (server-sent events), `completions` (the
chat and completions handlers), `server_thread` (`ServerThread`), `protocol` (the wire
format, `ServerLimits`, error bodies), `tools` (tool calls into prompts and out of
replies), `weights` (`/v1/weights`), `metrics` (Prometheus), `cli` (the `ridgeline serve`
command).

Nothing is re-exported here: every `ridgeline` command imports `serve.cli` to mount
`serve`, and FastAPI should load only when something is served.
"""

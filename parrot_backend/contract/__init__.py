"""The engine contract: what a manager and an engine agree on, in-process or over HTTP.

Torch-free and free of the rest of the package (it imports only pydantic and the standard
library), so the program, manager, server and every kind of engine import it, and a
manager-only node needs no GPU stack.

- `engine`: the interface (`EngineClient`: fill, generate, free, stats, tokenize,
  detokenize), `TokenDelta`, `EngineStats`.
- `sampling`: `SamplingParams` and `Constraint`, the one definition of how tokens are
  picked (the program's `GenerationConfig` converts to it; the engine API carries it).
- `errors`: the errors an engine reports to one request, and their HTTP statuses.
- `wire`: the engine API's HTTP format (request and response models, error mapping both
  ways, server-sent-event framing), spoken by `server.engine_api` and `engines.remote`.
"""

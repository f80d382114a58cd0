"""Engine kinds other than the in-process one, behind the same contract
(`parrot_backend.contract.engine.EngineClient`).

- `remote`: `RemoteEngine`, one of our engines in another process, over the engine API.
"""

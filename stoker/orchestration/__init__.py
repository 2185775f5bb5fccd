"""How stoker plugs into its orchestrator, Prefect: the result cache policy whose truth is the
object store, and its locks (`caching`, `cache_lock`); Prefect events and the stalled-run
automation (`prefect_events`); the best-effort publisher that never lets the server hold up a
run (`publish`); credentials blocks (`credentials`). No Prefect task or flow is defined here
(those are `tasks/` and `flows/`), and nothing here imports torch."""

"""stoker: Prefect flows that chain the life of an LLM pretraining run.

Rooms (each a subpackage or module; tests/test_architecture.py holds the import rules), lowest
first: failures, fields, families, config, contracts, arithmetic, process (what every room
shares), storage, data, launch, training, observe, preflight, orchestration, tasks, flows; the
command line is stoker.cli. Importing this
package imports nothing else: the ranks (stoker.training) never load Prefect.
"""

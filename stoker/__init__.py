"""stoker: Prefect flows that chain the life of an LLM pretraining run.

Rooms (each a subpackage; tests/test_architecture.py holds the import rules): core, storage,
data, launch, training, observe, tasks, flows; the command line is stoker.cli. Importing this
package imports nothing else: the ranks (stoker.training) never load Prefect.
"""

"""The processes people run: the CLI today; the control worker, machine agent and API later."""

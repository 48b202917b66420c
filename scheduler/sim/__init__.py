"""A discrete-event simulator that drives the very cycle function the live system calls."""

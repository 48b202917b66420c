"""Temporal workflows (JobWorkflow, ClusterSchedulerWorkflow). They orchestrate only; see design.md."""

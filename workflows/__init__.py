"""Temporal workflows (JobWorkflow, ClusterSchedulerWorkflow). They orchestrate only; see docs/live.md."""

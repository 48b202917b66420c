-- A new hold of a GPU opens no earlier than the GPU's last hold closed (queries.INSERT_HOLD), so
-- that a database clock stepped back cannot make it overlap a closed one: the latest end of a
-- GPU's holds, read from here, not from every hold the GPU ever had.
CREATE INDEX gpu_holds_by_gpu_end ON gpu_holds (machine_id, idx, upper(held));

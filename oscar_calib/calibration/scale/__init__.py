"""Scale-out of a calibration run, apart from its steps (data, capture, statistics, solve, clip fit, artifact in
`oscar_calib.calibration`): data-parallel ranks (`distributed`), the sharded and checkpointed capture loop
(`sharded_capture`, `checkpoint`), and the disk and memory budgets a run checks and reports (`disk_budget`,
`memory`). The job (`calibration.job`) is where the two meet."""

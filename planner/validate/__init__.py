"""`python -m planner validate`: the planner's predictions against the real mesh on this
machine.

    python -m planner validate [--seconds 5] [--skip-llm] [--reanalyse]

First `planner probe --mesh` measures this machine's roof and the mesh's own cost per call
(its CPU per call, the router's part of it, and the trip's p99 at three open-loop rates with
the cores each kept busy). Then each model x recipe is calibrated twice, outside the mesh:
its session timed alone (planner/calibrate.py: batch 1 and the largest, one thread as the
workers run it), and, for the encoders, served through a one-worker mesh at batch limits 2
and twice the largest checked (planner/serving.py: seconds per batch and host CPU per call at
saturation; no checked configuration is a calibration point). Then,
for each configuration (MiniLM fp32 / int8, 1-3 workers, two batch limits; SmolLM2 int8
weight-only through the LLM engine at two batch limits), it predicts three times (the bare
Roofline on the probed profile; fitted to the session alone; fitted to the one-worker mesh,
"served", the planner's best and the one judged) and measures:
- throughput: predicted capacity (saturation throughput) against a closed loop with enough
  callers to keep every replica's queue from running dry (4 x replicas x max batch, at
  least 8, at most 64);
- p99: predicted at an open-loop Poisson rate of half the measured throughput (stated in
  each row as offered_rps), against that run.
The workers' own statistics are read after each loop, so the batch the batcher formed and
its run time are known for the closed and the open loop apart. Workers and router share this
machine's cores with the client, so the prediction uses the shared-host form of the queueing
model (perfmodel/queueing.py). Every miss of the best prediction gets the reason the numbers
show: the batches, a replica's seconds per batch, the host CPU per call, the cores the open
loop kept busy. Writes planner.json, planner_roofline.png (this machine) and
planner_roofline_h200.png (the same models on the H200 profile) to benchmarks/results/.

`configs` holds what is checked and the settings, `predict` the three predictions of a row
and why the best one missed, `measure` one configuration's run through router + workers,
`run` the whole validation (and `--reanalyse`), `report` its section of benchmarks/README.md.
"""

"""`ember plan`: a job's per-rank memory, step time and verdict, on one CPU before booking the cluster.

memory.py   the run as ember.train.run resolves and builds it (plan_spec, build_parts) over a fake process group,
            and one step's memory tracked under fake tensors
cost.py     the analytic step time: FLOPs, collective volumes per mesh axis, link bandwidths, MFU
planner.py  make_plan: ranks by role, the verdict, the largest micro-batch that fits, --search
measure.py  the same bytes measured in real CPU runs (the plan's tests and benchmarks/plan_accuracy.py)

The command line, the table and plan.json are ember/commands/plan.py's.
"""

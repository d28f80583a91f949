r"""What Muon's step costs each rank of a cluster: owned matrices, Newton-Schulz FLOPs (standard
and Gram), bytes per TP mode, optimizer state, predicted time and share of an iteration.

    python tools/plan_muon.py --model llama3-70b --tensor-model-parallel-size 8 \
        --pipeline-model-parallel-size 4 --data-parallel-size 8 --use-distributed-optimizer \
        --global-batch-size 1024

The logic is megatron_eopt/training/planning/; docs/planner.md describes the output.
"""

from megatron_eopt.training.planning.cli import main

if __name__ == "__main__":
    main()

"""`make demo`: AdamW against Muon on the default small GPT, two processes each (torchrun).

Writes loss.png and summary.{json,txt} to --out-dir (default demo_output/); see
megatron_eopt/training/demo.py.
"""

from megatron_eopt.training.demo import main

if __name__ == "__main__":
    main()

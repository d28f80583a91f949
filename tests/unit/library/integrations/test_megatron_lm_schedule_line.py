"""The loop script's line for a checkpoint whose lr schedule differs from the command line's: megatron-core
counts the schedule's iterations in samples, and the line gives both (issue #98: "total number of
iterations 16" was 16 samples, 4 iterations of 4)."""

from megatron_eopt.integrations.megatron_lm_gpt import COUNTED_IN_SAMPLES, SCHEDULE_FLAGS, schedule_mismatch


def test_sample_counts_are_given_in_samples_and_iterations() -> None:
    line = schedule_mismatch("total number of iterations", 16, 48, global_batch_size=4)
    assert line.startswith("--load: the checkpoint's lr schedule has total number of iterations 16 samples (4 "
                           "iterations x --global-batch-size 4), this command line gives 48 samples (12 iterations x "
                           "--global-batch-size 4) (set by --lr-decay-iters"), line
    assert "warmup iterations 8 samples (2 iterations x --global-batch-size 4)" in schedule_mismatch(
        "warmup iterations", 8.0, 4.0, global_batch_size=4)  # megatron-core stores floats too
    # A ramping batch size (None) or a count that is no whole number of iterations: the samples alone.
    assert "has total number of iterations 16 samples, this command line gives 48 samples (set by" in schedule_mismatch(
        "total number of iterations", 16, 48)
    assert "has warmup iterations 6 samples, this command line gives 8 samples (2 iterations" in schedule_mismatch(
        "warmup iterations", 6, 8, global_batch_size=4)


def test_other_settings_keep_their_values() -> None:
    assert "has learning rate 0.001, this command line gives 0.002 (set by --lr)" in schedule_mismatch(
        "learning rate", 0.001, 0.002, global_batch_size=4)
    assert set(COUNTED_IN_SAMPLES) <= set(SCHEDULE_FLAGS)
    assert all("samples" in SCHEDULE_FLAGS[name] for name in COUNTED_IN_SAMPLES)  # their flags say so too

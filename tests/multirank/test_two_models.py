"""Two models in one process keep their own mesh, timeout, fp16 scaler and budget (issue 36, acceptance 3)."""

from multirank import run_ranks


def test_two_models_keep_their_own_state_through_training_reports_and_checkpoints(tmp_path):
    for result in run_ranks(2, "two_models_worker", {"root": str(tmp_path)}, timeout=300):
        assert result["separate_ledgers"] and result["meshes_differ"] and result["group_meshes"]
        assert result["timeouts"] == [45, 90] and result["loaded_timeouts"] == [45, 90]
        assert result["limits"] == [64 << 20, 32 << 20]
        scaler_a, scaler_b = result["scalers"]
        # A's second step overflowed in fp16: skipped, scale halved. B never scaled anything.
        assert scaler_a["skipped_steps"] == 1 and scaler_a["scale"] == 2.0**15
        assert scaler_b == {"scale": 2.0**16, "good_steps": 0, "skipped_steps": 0}
        assert result["loaded_scalers"] == result["scalers"]
        # Reports: one model's training or report never changes the other's figures; a container of both
        # adds them up (and merges no ledgers: separate_ledgers was read after it).
        assert result["a_unchanged_by_b_training"]
        assert result["a_unchanged_by_b_report"] and result["b_unchanged_by_a_report"]
        assert result["reports"]["a"] != result["reports"]["b"]
        assert result["both_params_device"] == result["sum_params_device"]
        # Each loaded copy continues exactly where its original is.
        for original, loaded in result["next_losses"]:
            assert original == loaded

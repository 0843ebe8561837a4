"""initialize_model_parallel creates the groups each layout asks for (2 gloo processes)."""

from tests.distributed.harness import run_distributed


def _layout_child(rank, world, *, layouts):
    from megatron.core import parallel_state as ps

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed

    seen = []
    for kwargs in layouts:
        initialize_model_parallel(ParallelConfig(**kwargs))
        set_seed(1)
        seen.append(
            {
                "tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
                "cp": ps.get_context_parallel_world_size(),
                "ep": ps.get_expert_model_parallel_world_size(),
                "dp": ps.get_data_parallel_world_size(),
            }
        )
    return seen


def test_layouts_on_two_processes():
    layouts = [
        dict(tensor_model_parallel_size=2),
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        dict(context_parallel_size=2),
        dict(expert_model_parallel_size=2),
        dict(),
    ]
    expected = [
        dict(tp=2, pp=1, vpp=None, cp=1, ep=1, dp=1),
        dict(tp=1, pp=2, vpp=2, cp=1, ep=1, dp=1),
        dict(tp=1, pp=1, vpp=None, cp=2, ep=1, dp=1),
        dict(tp=1, pp=1, vpp=None, cp=1, ep=2, dp=2),
        dict(tp=1, pp=1, vpp=None, cp=1, ep=1, dp=2),
    ]
    for rank_result in run_distributed(_layout_child, 2, layouts=layouts):
        assert rank_result == expected

"""Scheduler policy on the KV core (fake worker, no model)."""

from hisparse.config import KVCacheConfig
from hisparse.engine.simulate import Simulation


def test_preemption_does_not_cascade_while_victims_drain():
    """With acknowledgements one step late (as on a GPU), a preempted request frees its pages
    only after its mirrors land: the scheduler must not preempt the whole batch meanwhile."""
    cfg = KVCacheConfig(block_size=4, num_gpu_blocks=21, num_host_blocks=400,
                        num_indexer_blocks=400, max_model_len=64, index_topk=4, hot_buffer_size=4,
                        max_num_seqs=16, max_num_batched_tokens=16)
    sim = Simulation(cfg, seed=0, max_delay=1)
    sim.worker.rng.randint = lambda a, b: 1            # every ack exactly one step late
    events = []
    preempt = sim.scheduler.preempt

    def recording(req_id):
        before = sim.kv.num_free_gpu_blocks
        assert preempt(req_id)
        events.append((sim.scheduler.step_id, sim.kv.num_free_gpu_blocks - before))
        return True

    sim.scheduler.preempt = recording
    for i in range(16):
        sim.add([(i * 7 + j) % 50 for j in range(12)], 45)
    sim.run_to_completion(check=True)
    sim.check_all_free()
    assert events, "the pool is small enough to force preemption"
    for i, (step, freed) in enumerate(events[:-1]):
        assert not (freed == 0 and events[i + 1][0] == step), \
            f"step {step}: preempted again after a victim that freed nothing"

"""A prefill instance in its own process, for the tests that stop or kill one mid-transfer
(tests/engine/test_disagg.py). Reads one JSON line on stdin: ``{"path", "engine", "prompts"}``
(checkpoint, LLM keyword arguments, prompt dicts); prefills the prompts for a remote decode,
prints ``PARAMS <json list of kv_transfer_params>``, then serves its held prompts until killed,
printing ``STATUS <json>`` (held prompts, whether its pools are full) whenever that changes.
Lines of its own start with those words (NIXL logs to stdout too)."""

import json
import sys
import time

from hisparse import LLM, SamplingParams


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    llm = LLM(spec["path"], kv_role="prefill", **spec["engine"])
    outs = llm.generate(spec["prompts"], SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    print("PARAMS " + json.dumps([o.kv_transfer_params for o in outs]), flush=True)
    cfg, last = llm.kv_config, None
    while True:
        llm.service_kv_transfer()
        s = llm.stats()
        status = {"held": len(llm.disagg.held), "pools_full": (
            s["free_gpu_blocks"], s["free_host_blocks"], s["free_indexer_blocks"]) == (
            cfg.num_gpu_blocks, cfg.num_host_blocks, cfg.num_indexer_blocks)}
        if status != last:
            print("STATUS " + json.dumps(status), flush=True)
            last = status
        time.sleep(0.01)


if __name__ == "__main__":
    main()

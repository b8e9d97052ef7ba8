"""Run under torchrun by test_distributed_eval.py: the lm-eval adapter on a model sharded over the mesh given as
argv[3:] (`ici_mesh.fsdp=2`, ...), scoring the requests in argv[2] (JSON); rank 0 writes the results to argv[1]."""

import json
import sys

import torch.distributed as dist

from ember.eval.distributed import eval_mesh_overrides
from ember.eval.harness import EmberLM
from ember.eval.sharded import load_sharded
from ember.generate import tokenizer_for


class Request:
    def __init__(self, args: tuple) -> None:
        self.args = args


def main() -> None:
    out, requests_file, run = sys.argv[1], sys.argv[2], sys.argv[3]
    meshes = eval_mesh_overrides(sys.argv[4:])
    model, ranks = load_sharded(run, meshes)
    lm = EmberLM(model, tokenizer_for(run, None), batch_size=2, ranks=ranks)
    requests = json.loads(open(requests_file).read())
    results = {
        "loglikelihood": lm.loglikelihood([Request(tuple(r)) for r in requests["loglikelihood"]]),
        "rolling": lm.loglikelihood_rolling([Request((t,)) for t in requests["rolling"]]),
        "generate": lm.generate_until([Request((p, {"until": ["\n\n"], "max_gen_toks": 6}))
                                       for p in requests["generate"]]),
    }
    if dist.get_rank() == 0:
        open(out, "w").write(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What cuDNN's algorithm search (``torch.backends.cudnn.benchmark``) costs and buys for the
segment job's model: DeepLabV3-ResNet50 with random weights, the job's Segmenter
(channels-last, cast to DTYPE), one 520 x 520 input shape, on cuda:0.

    python benchmarks/cudnn_search.py SEARCH BATCH DTYPE   # e.g. 1 16 fp16, then 0 16 fp16

Prints one JSON line: import, model build and to-GPU seconds, the first forward (where the
search runs), and the steady images/s over 1536 images after it. Run each setting in its
own process: the search's results are cached per process.
"""

import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

from embedingest.stages.segmentation import Segmenter, load_segmentation_model  # noqa: E402

t_import = time.perf_counter()
search, batch, dtype = sys.argv[1] == "1", int(sys.argv[2]), sys.argv[3]
loaded = load_segmentation_model("deeplabv3_resnet50", None, 21, True)
t_build = time.perf_counter()
segmenter = Segmenter(loaded, torch.device("cuda:0"), dtype)
torch.cuda.synchronize()
t_device = time.perf_counter()
torch.backends.cudnn.benchmark = search
x = torch.randint(0, 255, (batch, 3, 520, 520), dtype=torch.uint8, device="cuda:0")
segmenter.masks(segmenter.logits(x))
torch.cuda.synchronize()
t_first = time.perf_counter()
segmenter.masks(segmenter.logits(x))
torch.cuda.synchronize()
t_second = time.perf_counter()
n = 1536 // batch
for _ in range(n):
    segmenter.masks(segmenter.logits(x))
torch.cuda.synchronize()
t_end = time.perf_counter()
print(json.dumps({"search": search, "batch": batch, "dtype": dtype,
                  "import_s": round(t_import - t0, 2), "build_s": round(t_build - t_import, 2),
                  "to_gpu_s": round(t_device - t_build, 2), "first_forward_s": round(t_first - t_device, 2),
                  "second_s": round(t_second - t_first, 3),
                  "images_per_s": round(n * batch / (t_end - t_second), 1)}))

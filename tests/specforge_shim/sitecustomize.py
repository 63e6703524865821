"""On PYTHONPATH of the SpecForge child processes in tests/test_specforge_train.py only: the test venv's
torchvision (PyPI's, linked against CUDA torch; tests/sglang-cpu-requirements.txt says why it is there)
cannot register its fake kernels beside torch+cpu, and transformers imports it when SpecForge's draft model
module loads. Declaring the two operator schemas lets it import (tests/real_sglang_driver.py does the same);
no torchvision operator runs. A venv without torchvision (`pip install -e '.[sim,prepare,train]'`) needs
nothing of this."""

try:
    import torch

    try:
        torch.ops.torchvision.nms
    except (AttributeError, RuntimeError):
        torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except ImportError:
    pass

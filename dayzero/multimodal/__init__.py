"""Images in prompts: decoding and checks, per-family preprocessing, and the vision towers whose
output features replace the image placeholder tokens."""
from dayzero.multimodal.image import ImageLimits, decode_image, load_image, to_rgb  # noqa: F401
from dayzero.multimodal.processors import (  # noqa: F401
    ImageInputs,
    KimiK25ImageProcessor,
    Qwen3VLImageProcessor,
    navit_resize,
    smart_resize,
)

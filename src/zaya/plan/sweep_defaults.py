"""What a GEMM sweep (`zaya shapes`) measures unless told otherwise. Kept apart from the sweep, which loads torch,
so that `zaya shapes --help` can show them and `zaya --help` stays quick."""

DEFAULT_TOKENS = (1024, 2048, 4096, 8192)  # tokens per micro-batch: the GEMMs' rows
DEFAULT_SEQ_LENS = (256, 512, 1024, 2048, 4096)  # the attention's sequence lengths
DEFAULT_BUDGET_S = 60.0  # seconds of timing in all; the shapes left are skipped
DEFAULT_SHAPE_CAP_S = 2.0  # seconds at most per shape

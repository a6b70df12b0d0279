"""Planning: predictions of a run's memory, communication and time before it runs (`zaya plan`), and the GEMM
sweep that measures the local device (`zaya shapes`)."""

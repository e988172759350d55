"""`cosyvoice-bench`: latency, RTF, throughput and memory of a runtime bundle, beside the torch reference.

The runtime part (numpy + onnxruntime) never imports torch; `torch_runs` is imported only for
`--vs-torch`.
"""

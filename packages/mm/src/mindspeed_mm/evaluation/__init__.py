"""``mindspeed-mm evaluate``: multiple-choice and short-answer VQA accuracy on local MMBench-style TSV and JSON files."""

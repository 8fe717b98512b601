"""`ddloco compare`: the quality instrument. Same task, data streams, inner AdamW and eval
batches for every system; evaluation at exact token counts; several seeds."""

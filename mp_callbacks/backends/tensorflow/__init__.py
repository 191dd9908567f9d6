"""Keras's TensorFlow backend: the loss-scaled step (`step`, and the skip
mechanisms it uses: `skip`, `gated_update`, `unscale_stage`,
`forward_writes`, `step_record`) and what the backend-neutral modules ask
of it (`platform`: the hardware advisor's probe, devices and build)."""

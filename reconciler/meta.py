"""Image-meta keys this reconciler records on the images it manages."""

PREFIX = "rbd-reconciler."
OWNER = PREFIX + "owner"  # node that created the image; only it may delete it
SPEC_HASH = PREFIX + "spec-hash"  # the spec the image last converged to
FORMATTED = PREFIX + "formatted"  # fs type after our mkfs; never mkfs over it again
GROW_PENDING = PREFIX + "grow-pending"  # online grow refused: grow offline at next stage

"""Image-meta keys this reconciler records on the images it manages."""

PREFIX = "rbd-reconciler."
OWNER = PREFIX + "owner"  # node that created the image; only it may delete it
SPEC_HASH = PREFIX + "spec-hash"  # the spec the image last converged to
FORMATTED = PREFIX + "formatted"  # fs type after our mkfs; never mkfs over it again
# Set just before our mkfs, cleared after FORMATTED: if it is still there, our
# own mkfs was interrupted (crash, SIGKILL) and whatever it left may be redone.
FORMATTING = PREFIX + "formatting"
GROW_PENDING = PREFIX + "grow-pending"  # online grow refused: grow offline at next stage
HOLDER = PREFIX + "holder"  # node that has the image mapped (for explain; informational)

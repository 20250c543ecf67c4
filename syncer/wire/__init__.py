"""What learners, the syncer and the operator say to each other: the wire (leaves: no other project imports).

- `protocol`: message framing, validation and the message kinds;
- `codec`: compression of outer gradients and global-fragment changes;
- `fragments`: the balanced split of a model's tensors into fragments, shared by both ends.
"""

"""What a run leaves on disk, below data and train: the folder's one-writer lock (``lock``) and its checkpoint
folders (``checkpoint``). Design: specopd/runs/DESIGN.md."""

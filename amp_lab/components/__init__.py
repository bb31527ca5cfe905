"""The run's building blocks: data (timm's transforms, mixup), models, optimizers, the training
loss, the model EMA, LR schedules, metrics, CPU threads, the DDP world and torch.compile."""

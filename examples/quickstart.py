import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from accelerate_stateful import Accelerator  # subclass of accelerate.Accelerator

set_seed(0)
accelerator = Accelerator(
    dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    project_config=ProjectConfiguration(
        project_dir="runs/quickstart", automatic_checkpoint_naming=True, total_limit=3
    ),
)
dataset = torch.utils.data.TensorDataset(torch.randn(1000, 8), torch.randn(1000, 1))
train_dl = torch.utils.data.DataLoader(
    dataset, batch_size=16, shuffle=True, num_workers=2
)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
num_epochs, save_every = 3, 10

accelerator.resume()  # the newest complete checkpoint under runs/quickstart, or None
for epoch in range(train_dl.epoch, num_epochs):
    for x, y in train_dl:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # any schedule: every save point resumes exactly
        if train_dl.batches_yielded % save_every == 0:
            accelerator.save_state()
accelerator.print(f"done: epoch {train_dl.epoch}, loss {loss.item():.4f}")

"""A demo on how to setup custom trainer with efficient training"""
import sys
import torch
import torch.nn as nn
from torch.utils.data import Dataset
from elastictrain.train.session import Session


class MyTrainDataset(Dataset):
    """Random 12x12 images, each labelled by a fixed random projection; the same on every rank."""

    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.rand(size, 1, 12, 12, generator=generator)
        self.labels = (self.images.flatten(1) @ torch.randn(144, 10, generator=generator)).argmax(1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 4, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(
            nn.Conv2d(4, 8, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(3*3*8, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc(out)
        return out


class Trainer:
    def __init__(
        self,
        session: Session,
        model: torch.nn.Module,
        train_data,
        optimizer: torch.optim.Optimizer,
        criterion: torch.nn.Module,
    ) -> None:
        self.session = session
        self.global_rank = session.rank
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.criterion = criterion

        self.model = session.wrap(self.model)
        self._save_snapshot()
        self._load_snapshot()

    def _load_snapshot(self):
        """Resume training from the newest snapshot (a fresh start when there is none)"""
        self.session.restore()

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = self.criterion(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int, total_epochs: int):
        self.model.train()
        for i, (source, targets) in enumerate(self.train_data):
            loss = self._run_batch(source, targets)
            self.session.step(loss=loss)
            if (i + 1) % 100 == 0 and self.global_rank == 0:
                print(
                    f'[CPU{self.global_rank}] Epoch [{epoch + 1}/{total_epochs}], Step [{self.session.global_step}], Loss: {loss:.4f}')

    def _save_snapshot(self):
        """What every snapshot holds (written every snapshot.durable.every_steps steps, on preemption and at the end)"""
        self.session.register(
            model=self.model,
            optimizer=self.optimizer,
        )

    def train(self, total_epochs: int):
        """Training script"""
        for epoch in self.session.epochs():
            self._run_epoch(epoch, total_epochs)


def load_train_params():
    train_set = MyTrainDataset(256)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    criterion = torch.nn.CrossEntropyLoss()
    return train_set, model, optimizer, criterion


CONFIG = {
    "run": {"name": "tutorial", "seed": 42},
    "train": {"max_epochs": 4, "batch_size": 16},
    "snapshot": {"durable": {"every_steps": 5}},
}


def run(overrides):
    """Run entire pipeline"""
    with Session(CONFIG, overrides) as session:
        torch.manual_seed(session.config.run.seed)
        dataset, model, optimizer, criterion = load_train_params()
        train_data = session.loader(dataset)
        trainer = Trainer(session, model, train_data, optimizer, criterion)
        trainer.train(session.config.train.max_epochs)


def main():
    run(sys.argv[1:])  # key=value overrides: train.max_epochs=8 run.dir=runs/tutorial


if __name__ == "__main__":
    main()

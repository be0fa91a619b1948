import abc

from slime.utils.types import Sample


class DataSource(abc.ABC):
    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Return num_samples samples"""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]):
        """Add samples to the data source"""

    @abc.abstractmethod
    def save(self, rollout_id):
        """Save the state of the data source"""

    @abc.abstractmethod
    def load(self, rollout_id=None):
        """Load the state of the data source"""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Length of the data source."""

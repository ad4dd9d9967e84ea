//! gpuexp's core: memory experiment scopes for notebooks. Everything with state lives here;
//! the Python package is the IPython glue and the public surface.

/// The cell log's share of torch's allocation history: joined, kept across cells, given back.
pub mod cell_history;
/// Finished experiments side by side: a table, JSON, and peaks against a param with a fit.
pub mod compare;
/// cuDNN's recurrent layers as an estimate sees them: why it refuses them, and what to do.
pub mod cudnn_rnn;
/// What can go wrong, by kind: no driver, a failed NVML call, bad input, a file.
pub mod error;
/// A step's memory predicted under fake tensors: the peak, what made it up, whether it fits.
pub mod estimate;
/// An estimate's books while its step runs: which storage is which ledger entry.
pub mod estimate_books;
/// How an estimate runs its step under fake tensors: on which memory, how many calls, what it says.
pub mod estimate_run;
/// How one device's memory adds up: torch's tensors by role, its cache, what torch does not track.
pub mod explain;
/// Paths a user names: regular files read without waiting, files written whole atomically.
pub mod files;
/// The batch-size finder's search: predict from a few trials, verify, bisect when wrong.
pub mod finder;
/// What to change so a step fits: options predicted under fake tensors, ranked, with their code.
pub mod fit;
/// Fork safety: state kept per process, the one fork hook, and NVML kept clean across a fork.
pub mod fork;
/// Tables: one set of cells, rendered as text and as HTML.
pub mod grid;
/// The leak hunter's walk: roots, their order, path names, each storage counted once.
pub mod holders_walk;
/// Host memory by line through tracemalloc: its share, opening and finish, over a trait.
pub mod host_tracing;
/// Torch's snapshot pickles of the latest traced reports, for `save_snapshot`.
pub mod kept_snapshots;
/// The view of a running cell's memory, and when it is drawn.
pub mod live_view;
/// Locks that outlive a panic while they were held.
pub mod locks;
/// The timeline: a thread that records figures at an interval into JSON Lines or CSV.
pub mod monitor;
/// The rescue after a CUDA out-of-memory error: its steps in order, and its diagnosis.
pub mod oom_rescue;
/// What an experiment varied (`params=`, or `bs=64` in its name): below the reports and the
/// trace's diffs, which both show it.
pub mod params;
/// The thread that raises peaks between snapshots where no peak counter exists.
pub mod peak_sampler;
/// Experiments across processes: each rank's report published to torch.distributed's store, gathered.
pub mod ranks;
/// The flight recorder's side of an OOM: step ends, and what a record without stacks tells.
pub mod recorder;
/// One recording shared by its clients (torch's history, tracemalloc): who starts, switches, stops it.
pub mod recording_lease;
/// What a scope, a cell, an OOM or a leak hunt found, as JSON and tables.
pub mod report;
/// What a step reads from fake tensors (`.item()`): the stand-ins, why a read stops an estimate,
/// and whether this thread is running a step on fakes (`gpuexp.estimating()`).
pub mod scalar_reads;
/// The registry of scopes: nesting, start snapshots, peak windows, history.
pub mod scope;
/// One reading of host memory, NVML and torch's allocator.
pub mod snapshot;
/// Which training steps of a traced experiment record Python stacks (`trace=True`'s sampling).
pub mod stack_sampling;
/// `gpuexp status`: the driver and every device.
pub mod status;
/// What a step reaches besides its model and optimizers, saved before an estimate and put back after.
pub mod step_state;
/// Which names a scope deletes, and the order of teardown's steps.
pub mod teardown;
/// Torch's allocation history run for its clients, in a fixed order over a trait.
pub mod torch_history;
/// Where in the code: torch's allocation history replayed, its peak, leaks and OOMs by source line.
pub mod trace;
/// Training runs measured by a framework's callback: their position, intervals and metrics.
pub mod training;
/// Objects a namespace walk could not inspect: skipped, counted, said in one note.
pub mod uninspectable;
/// Sizes and times as people read and write them.
pub mod units;
/// `gpuexp watch`: a refresh every interval, live, CSV or JSON lines.
pub mod watch;

/// The PyO3 module `gpuexp._core`: the only code that knows Python.
#[cfg(feature = "python")]
mod bindings;

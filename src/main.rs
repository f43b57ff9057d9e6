use std::io::IsTerminal;

use clap::Parser;
use sidelock::cli::{Cli, Command};
use sidelock::config::{LogFormat, Settings};
use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Logs what `SIDELOCK_LOG` asks for, but never a dependency's events above
/// INFO: at debug and trace, drivers print statement parameters (lease
/// tokens: tokio-postgres), node data, connection settings and request
/// heads. The cap applies after the user's directives, to every target that
/// is not sidelock's own, so no `SIDELOCK_LOG` value (a target, a span, a
/// field filter) and no future dependency can lift it.
fn init_tracing(format: LogFormat) {
    let wanted = EnvFilter::try_from_env("SIDELOCK_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let cap = Targets::new()
        .with_default(LevelFilter::INFO)
        .with_target("sidelock", LevelFilter::TRACE);
    let filter = wanted.and(cap);
    let registry = tracing_subscriber::registry();
    // Colour only for a person at a terminal: a file, a pipe or a container
    // runtime's log would keep the escape codes as text.
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => registry.with(layer.with_filter(filter)).init(),
        LogFormat::Json => registry.with(layer.json().with_filter(filter)).init(),
    }
}

/// Waiting connections' untouched buffer pages stay non-resident (see the module).
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: sidelock::alloc::Pages = sidelock::alloc::Pages;

fn main() -> std::process::ExitCode {
    // Before any thread allocates: the arena limit is read when the second
    // arena would be made.
    sidelock::alloc::share_one_arena();
    let cli = Cli::parse();
    let args = match cli.command {
        Some(Command::Run(args)) => {
            return on_runtime(None, async {
                let code = sidelock::run::run(args).await;
                std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
            });
        }
        Some(Command::Campaign(args)) => {
            return on_runtime(None, async {
                let code = sidelock::campaign::campaign(args).await;
                std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
            });
        }
        Some(Command::Serve(args)) => args,
        None => cli.serve,
    };
    // Resolved before the runtime starts: it sizes the runtime.
    let settings = match Settings::resolve(args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sidelock: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    on_runtime(settings.threads, serve(settings))
}

/// Runs `main` on a runtime of `threads` workers (`None`: one per CPU).
fn on_runtime(
    threads: Option<usize>,
    main: impl std::future::Future<Output = std::process::ExitCode>,
) -> std::process::ExitCode {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        builder.worker_threads(n);
    }
    match builder.enable_all().build() {
        Ok(runtime) => runtime.block_on(main),
        Err(e) => {
            eprintln!("sidelock: cannot start the runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Serves until shutdown (`sidelock serve`, the default command).
async fn serve(settings: Settings) -> std::process::ExitCode {
    init_tracing(settings.log_format);
    match sidelock::sidecar::serve(settings).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}

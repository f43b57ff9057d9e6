use clap::Parser;
use sidelock::config::{Cli, Command, LogFormat, Settings};
use tracing_subscriber::EnvFilter;

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_env("SIDELOCK_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
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
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(run_command()),
        Err(e) => {
            eprintln!("sidelock: cannot start the runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs the command line's command: `serve` (the default), `run` or `bench`.
async fn run_command() -> std::process::ExitCode {
    let cli = Cli::parse();
    let serve = match cli.command {
        Some(Command::Run(args)) => {
            let code = sidelock::run::run(args).await;
            return std::process::ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        Some(Command::Bench(args)) => {
            let code = sidelock::bench::bench(args).await;
            return std::process::ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        Some(Command::Serve(args)) => args,
        None => cli.serve,
    };
    let settings = match Settings::resolve(serve) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sidelock: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    init_tracing(settings.log_format);
    match sidelock::sidecar::serve(settings).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}

//! The command line: `sidelock [serve]`, `sidelock run` and `sidelock campaign`,
//! each subcommand's flags defined beside the code that runs it.

use clap::{Parser, Subcommand};

use crate::config::ServeArgs;

/// `sidelock`: a distributed-lock sidecar.
#[derive(Debug, Parser)]
#[command(
    name = "sidelock",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
// Parsed once at start-up; boxing the serve flags would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run the sidecar (the default).
    Serve(ServeArgs),
    /// Hold a lock through a sidecar while a command runs.
    Run(crate::run::RunArgs),
    /// Run a command only while leading an election through a sidecar.
    Campaign(crate::campaign::CampaignArgs),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    #[test]
    fn debug_output_shows_no_token_or_backend_password() {
        let cli = Cli::try_parse_from([
            "sidelock",
            "serve",
            "--api-token",
            "api-secret-1",
            "--admin-token",
            "admin-secret-2",
            "--backend",
            "redis://user:pw-secret-3@127.0.0.1:6379/0",
        ])
        .unwrap();
        let mut printed = format!("{cli:?}");
        let Some(Command::Serve(args)) = cli.command else {
            panic!("serve expected")
        };
        let settings = Settings::resolve(args).unwrap();
        printed.push_str(&format!("{settings:?}"));
        for secret in ["api-secret-1", "admin-secret-2", "pw-secret-3"] {
            assert!(!printed.contains(secret), "{secret} in {printed}");
        }
        assert_eq!(settings.api_token.as_deref(), Some("api-secret-1"));
        assert!(settings.backend.contains("pw-secret-3"));
    }
}

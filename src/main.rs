use clap::Parser;
use postcache::{
    config::{Cli, Command},
    startup::{shutdown_signal, Application},
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    postcache::telemetry::init(cli.log_format);
    match cli.command {
        Command::Migrate(db) => {
            postcache::db::migrate(&db).await?;
            tracing::info!("migrations applied");
        }
        Command::Seed(args) => {
            postcache::cli::seed::run(&args).await?;
        }
        Command::Invalidate(args) => {
            print!("{}", postcache::cli::invalidate::run(&args).await?);
        }
        Command::Serve(args) => {
            let app = Application::build(*args).await?;
            app.run_until_stopped(shutdown_signal()).await?;
        }
    }
    Ok(())
}

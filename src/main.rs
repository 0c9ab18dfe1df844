use clap::Parser;
use postcache::{
    config::{Cli, Command, SlotCommand},
    startup::{shutdown_signal, Application},
};

/// jemalloc rather than glibc's malloc: under load, glibc's arenas contend
/// (a buffer allocated by one worker is often freed by another; A/B on hits
/// in Redis: 66k against 53k requests/s) and never give back what a burst
/// freed. Its background thread returns freed pages after a few seconds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start (`_RJEM_MALLOC_CONF` overrides).
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8] = b"background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:5000\0";

/// Longest the exit waits for the last spans to be exported.
const TRACES_FLUSH: std::time::Duration = std::time::Duration::from_secs(2);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Err(error) = postcache::telemetry::init(cli.log_format) {
        eprintln!("error: {error:#}");
        std::process::exit(2);
    }
    postcache::startup::install_tls_provider();
    match cli.command {
        Command::Migrate(db) => {
            postcache::store::migrate(&db).await?;
            tracing::info!("migrations applied");
        }
        Command::Seed(args) => {
            postcache::cli::seed::run(&args).await?;
        }
        Command::Invalidate(args) => {
            print!("{}", postcache::cli::invalidate::run(&args).await?);
        }
        Command::Inspect(args) => {
            let inspection = postcache::cli::inspect::run(&args).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&inspection)?);
            } else {
                print!("{inspection}");
            }
        }
        Command::Healthcheck(args) => match postcache::cli::healthcheck::run(&args).await {
            Ok(200) => println!("ok"),
            Ok(status) => {
                eprintln!("{} answered {status}", args.path);
                std::process::exit(1);
            }
            Err(error) => {
                eprintln!("{error:#}");
                std::process::exit(1);
            }
        },
        Command::Slot(SlotCommand::List(args)) => {
            let slots = postcache::cli::slot::list(&args).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&slots)?);
            } else {
                print!("{slots}");
            }
        }
        Command::Slot(SlotCommand::Drop(args)) => {
            print!("{}", postcache::cli::slot::drop(&args).await?);
        }
        Command::Serve(args) => {
            let app = Application::build(*args).await?;
            let served = app.run_until_stopped(shutdown_signal()).await;
            // The spans of the last requests, exported before the exit,
            // for at most TRACES_FLUSH: a collector that does not answer
            // must not hold the exit past the grace period.
            let (flushed, done) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                postcache::telemetry::traces::shutdown();
                let _ = flushed.send(());
            });
            let _ = tokio::task::spawn_blocking(move || done.recv_timeout(TRACES_FLUSH)).await;
            served?;
        }
    }
    Ok(())
}

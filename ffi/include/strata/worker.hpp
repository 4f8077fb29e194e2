// One named thread, kept for its owner's life, that runs one job at a time.
//
// The issuer walk runs on it: a chunk's walk then starts without a thread's
// creation on its critical path (a thread made per chunk put its creation between
// begin_chunk's handler and the first copy).
// Between jobs the thread waits on a condition variable and touches nothing of
// its owner.
#pragma once

#include <condition_variable>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "strata/thread_name.hpp"

namespace strata {

class Worker {
 public:
  // `name`: a string literal (at most 15 characters), the thread's name.
  explicit Worker(const char* name) : name_(name) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Waits for a running job, then ends the thread.
  ~Worker() {
    Wait();
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Runs `job` on the worker's thread, made on first use (std::system_error
  // if it cannot be). std::logic_error if the previous job has not returned.
  // A job should handle its own errors: one that lets an exception escape is
  // reported on stderr and dropped, so the process and the worker live on.
  void Run(std::function<void()> job) {
    std::unique_lock<std::mutex> lock(mu_);
    if (busy_)
      throw std::logic_error(std::string("strata::Worker ") + name_ +
                             ": a job was given while the last one still runs");
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    job_ = std::move(job);
    busy_ = true;
    lock.unlock();
    cv_.notify_all();
  }

  // Returns once the job given to Run has returned; at once when none runs.
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !busy_; });
  }

  // Whether a job was given and has not returned yet.
  bool busy() const {
    std::lock_guard<std::mutex> lock(mu_);
    return busy_;
  }

 private:
  void Loop() {
    NameThisThread(name_);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return quit_ || job_ != nullptr; });
      if (job_ == nullptr) return;  // quit, nothing queued
      std::function<void()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      try {
        job();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "strata: a job on thread %s raised: %s\n", name_, e.what());
      } catch (...) {
        std::fprintf(stderr, "strata: a job on thread %s raised an unknown exception\n",
                     name_);
      }
      job = nullptr;  // the job's captures go before the waiter returns
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  const char* name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool busy_ = false;
  bool quit_ = false;
  std::thread thread_;
};

}  // namespace strata
